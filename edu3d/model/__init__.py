"""The serial reference GPT and the model shapes the planner reads."""
