"""After-the-fact investigations: where a leak, a NaN or an OOM came from."""
