"""Model building blocks: linear (+ quantized), attention, norm, rotary, activation, sampler."""
