"""Sinks that read step records: spans, metrics, run-directory files, the HTTP server."""
