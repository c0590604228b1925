"""Forensics: NaN localisation by replay, out-of-memory records, explicit anomaly detection."""

from torchtrace.forensics.anomaly import anomaly_detection
from torchtrace.forensics.replay import replay as replay_step

__all__ = ["anomaly_detection", "replay_step"]
