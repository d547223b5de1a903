"""Commands built on the core and the store that are not services: synthetic traces, the demo,
calibrate, the Grafana dashboard, the Prometheus rules and the pre-run gate."""
