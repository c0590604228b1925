"""Callbacks for training frameworks. Importing this package imports no framework.

- :mod:`torchtrace.integrations.lightning`: ``TorchtraceCallback`` for PyTorch Lightning
  (``pip install "torchtrace[lightning]"``).
- :mod:`torchtrace.integrations.transformers`: ``TorchtraceCallback`` for the Hugging Face
  ``Trainer`` (``pip install "torchtrace[transformers]"``).
"""

__all__: list[str] = []
