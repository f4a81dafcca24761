"""Prometheus, Alertmanager and Grafana files, shipped as package data (``meshscope.grafana``) so
``meshscope stack`` works from an installed wheel."""
