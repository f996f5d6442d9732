"""Shared fixtures and helpers of the suite; no test module imports another."""
