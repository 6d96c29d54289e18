// A CUDA C++ row norm for bf16 rows of 4096 / 8192 lanes, one row per block, 16-byte vectors
// held in registers across the block reduction. An experiment, not a shipped kernel: it measures
// what a kernel written outside Triton does at the decode rows the Triton kernels have not closed
// (BENCHMARKS.md, "fifteenth day"). Built at run time by cuda_rownorm.py.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>

template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  constexpr int WARPS = THREADS / 32;
  if constexpr (WARPS == 1) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < WARPS ? smem[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ void unpack(const uint4& raw, float* f) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) { float2 t = __bfloat1622float2(p[k]); f[2 * k] = t.x; f[2 * k + 1] = t.y; }
}

__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 raw;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) p[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  return raw;
}

template <int H, int THREADS, bool GEMMA, bool RESIDUAL>
__global__ void __launch_bounds__(THREADS) norm_kernel(const __nv_bfloat16* __restrict__ x,
    __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ w,
    __nv_bfloat16* __restrict__ out, float eps) {
  constexpr int VPT = H / (8 * THREADS);
  __shared__ float smem[32];
  const unsigned row = blockIdx.x;
  const uint4* xr = reinterpret_cast<const uint4*>(x) + row * (H / 8);
  uint4* rr = reinterpret_cast<uint4*>(residual) + row * (H / 8);
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  uint4* orow = reinterpret_cast<uint4*>(out) + row * (H / 8);
  float v[VPT][8];
  uint4 wraw[VPT];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = i * THREADS + threadIdx.x;
    unpack(xr[idx], v[i]);
    if constexpr (RESIDUAL) {
      float r[8];
      unpack(rr[idx], r);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[i][k] += r[k];
      rr[idx] = pack(v[i]);
    }
    wraw[i] = __ldg(wr + idx);
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += v[i][k] * v[i][k];
  }
  const float rstd = rsqrtf(block_sum<THREADS>(ss, smem) / H + eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    float wf[8], y[8];
    unpack(wraw[i], wf);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if constexpr (GEMMA) {
        y[k] = v[i][k] * rstd * (1.f + wf[k]);
      } else {  // llama casting: round the normalised value, then multiply in bf16
        y[k] = __bfloat162float(__float2bfloat16_rn(v[i][k] * rstd)) * wf[k];
      }
    }
    orow[i * THREADS + threadIdx.x] = pack(y);
  }
}

template <int H, int T>
void launch_ht(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, const torch::Tensor& out,
               float eps, bool gemma, bool has_r) {
  if constexpr (H % (8 * T) != 0 || H / (8 * T) == 0) {
    TORCH_CHECK(false, "threads too many for the width");
  } else {
    auto s = at::cuda::getCurrentCUDAStream();
    const int rows = x.size(0);
    auto px = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
    auto pr = has_r ? reinterpret_cast<__nv_bfloat16*>(r.data_ptr()) : nullptr;
    auto pw = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
    auto po = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    if (gemma && has_r) norm_kernel<H, T, true, true><<<rows, T, 0, s>>>(px, pr, pw, po, eps);
    else if (gemma) norm_kernel<H, T, true, false><<<rows, T, 0, s>>>(px, pr, pw, po, eps);
    else if (has_r) norm_kernel<H, T, false, true><<<rows, T, 0, s>>>(px, pr, pw, po, eps);
    else norm_kernel<H, T, false, false><<<rows, T, 0, s>>>(px, pr, pw, po, eps);
  }
}

template <int H>
void launch_h(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, const torch::Tensor& out,
              float eps, bool gemma, bool has_r, int64_t threads) {
  switch (threads) {
    case 64: return launch_ht<H, 64>(x, r, w, out, eps, gemma, has_r);
    case 128: return launch_ht<H, 128>(x, r, w, out, eps, gemma, has_r);
    case 256: return launch_ht<H, 256>(x, r, w, out, eps, gemma, has_r);
    case 512: return launch_ht<H, 512>(x, r, w, out, eps, gemma, has_r);
    case 1024: return launch_ht<H, 1024>(x, r, w, out, eps, gemma, has_r);
    default: TORCH_CHECK(false, "threads");
  }
}

void norm(torch::Tensor x, torch::Tensor r, torch::Tensor w, torch::Tensor out, double eps, bool gemma,
          bool has_r, int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && out.is_contiguous());
  const int64_t h = x.size(1);
  if (h == 4096) launch_h<4096>(x, r, w, out, (float)eps, gemma, has_r, threads);
  else if (h == 8192) launch_h<8192>(x, r, w, out, (float)eps, gemma, has_r, threads);
  else TORCH_CHECK(false, "width");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
