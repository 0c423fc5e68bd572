"""Deployment tests: deploy/slurm on a real Slurm, deploy/prometheus on a real Prometheus, the Grafana dashboard."""
