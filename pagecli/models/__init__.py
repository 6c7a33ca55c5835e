"""Model sources, loading, and the lean decoder implementations."""
