"""Pure PyTorch measurements: tensors in, device tensors or small dataclasses out.

Nothing here imports telemetry, and nothing here reads a device value to the host: that
happens once per step in :mod:`torchtrace.record.readout`.
"""
