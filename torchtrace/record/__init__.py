"""Per-step records: the one place device values reach the host, anomaly rules, history."""
