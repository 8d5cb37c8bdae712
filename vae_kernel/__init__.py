"""The fast Wan2.2 VAE decoder (portable PyTorch path and compiled CUDA path). Importable without FastVideo."""
