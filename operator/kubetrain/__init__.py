"""kubetrain: the TrainingJob operator (kopf). Layers: api -> plan -> k8s -> handlers."""
