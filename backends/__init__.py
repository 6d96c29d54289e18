"""Platform backends, installed as ``customop.backends``; one package per platform.

Backends are imported on first use (``customop.backend_loader.load_backend``), never by
``import customop``. See README.md in this folder for how to add one.
"""
