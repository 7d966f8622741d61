"""Built-in environments for multi-turn episodes (docs/agents.md): small games and tool tasks
that the demo model can learn on a CPU. Each is loaded like a user's, as ``module:Class``."""
