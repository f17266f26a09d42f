"""Watching the cluster: polling the exporters, the dashboard, Prometheus and Grafana configuration."""
