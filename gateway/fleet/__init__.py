"""The backends: their state, health checks, engines, outlier ejection, shared state, the upstream client."""
