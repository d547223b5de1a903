"""The long-running processes and what they serve: the per-node agent, the watcher with its
Alertmanager client, the Prometheus collectors and the Kubernetes job registration."""
