"""kubetrain: the TrainingJob operator (kopf). Layers: api -> plan -> k8s -> reconciler -> handlers (pyproject.toml)."""
