"""The software stack a node needs: NVIDIA driver and CUDA runtime against the torch build, and the locks."""
