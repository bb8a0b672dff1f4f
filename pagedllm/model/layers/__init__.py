"""Building blocks of Llama-family models: linears (TP-ready), RMSNorm, rotary, activations."""
