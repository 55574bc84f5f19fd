"""DFlash drafter training (prompts, data generation, the objective, the loop, evaluation, its CLI): a tool, not on the serving import path."""
