"""Pure DAPO algorithm functions: tensors in, tensors out, no process groups."""
