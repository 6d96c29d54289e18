"""`import customop` stays light: no triton, jax, torch_xla, IPEX or transformers until a backend
(or the transformers integration's caller) brings them."""

import subprocess
import sys
import textwrap

BLOCKED = ("triton", "jax", "jaxlib", "torch_xla", "intel_extension_for_pytorch", "transformers")

SCRIPT = textwrap.dedent(f"""
    import sys
    BLOCKED = {BLOCKED!r}

    # A None entry in sys.modules makes the module look absent to find_spec and makes importing
    # it raise ModuleNotFoundError: exactly a machine without the package.
    for name in BLOCKED:
        sys.modules[name] = None

    import customop
    from customop.cli import main
    platform = customop.current_platform
    assert main(["info"]) == 0
    # Every op's native path runs without them too (fp32 samples, ops disabled).
    import torch
    from customop import Config, CustomOp, use_config
    from customop.testing import op_samples
    ran = 0
    for name in customop.list_ops():
        samples = op_samples(name)
        if samples is None:
            continue
        for sample in samples.build(torch.float32, "cpu", torch.Generator().manual_seed(0)):
            with use_config(Config(custom_ops=["none"])):
                op = CustomOp.op_registry[name](**sample.init_kwargs)
            op(*sample.args, **sample.kwargs)
            ran += 1
    print("NATIVE SAMPLES", ran)
    # the transformers integration recognises modules by name: it never imports transformers
    from customop.integrations.transformers import patch
    assert patch(torch.nn.Sequential(torch.nn.Linear(2, 2))) == {{}}
    loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("PLATFORM", platform.name)
""")


def test_import_and_info_without_optional_backends():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PLATFORM cpu" in result.stdout


def test_plain_import_loads_no_optional_backend():
    code = ("import sys, customop; customop.current_platform; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
