"""The model side: weights, the llama-family model, inputs, forward and sampling."""
