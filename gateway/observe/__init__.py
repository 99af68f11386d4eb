"""What operators see: metrics, logs, the dashboard."""
