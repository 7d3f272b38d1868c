"""The quality studies behind eval/: the lm-eval model, the parity report, the study queue, the frontier."""
