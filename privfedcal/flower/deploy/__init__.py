"""Tooling that deploys a run on a local Flower federation (SuperLink, SuperNodes, warm ClientApp processes, TLS credentials); apart from the plugin, which a user's own app imports."""
