"""The spec of every op family as pure PyTorch functions, one module per family.

Each op's ``forward_native`` runs these; the ``torch.ops.customop.*`` entry points use them as
their reference bodies; backends reproduce them. Imports nothing but torch (and each other).
"""
