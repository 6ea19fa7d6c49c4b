"""Analytic models of scheduling policies, checked against the simulator."""
