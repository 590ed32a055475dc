"""stalwart: fault-tolerant distributed PyTorch training on Kubernetes."""
