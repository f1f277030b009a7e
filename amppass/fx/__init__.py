"""The torch.fx front end: capture, the ATen op policy, painting input and the graph rewrite."""
