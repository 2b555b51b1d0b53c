"""End-to-end tier: helm install, the operator, real training through the test node agent."""
