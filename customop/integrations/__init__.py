"""Integrations with model libraries: customop's ops inside models written against another API.

``customop.integrations.transformers`` swaps the layers of a Hugging Face ``transformers`` model
for customop ops (``patch`` / ``unpatch``). Nothing is imported here, so ``import customop``
(and this package) never imports transformers; the submodule itself does not import it either:
it recognises the model's modules by their class and module names.
"""
