"""The fast decoder and encoder in diffusers' Wan VAE (docs/design/diffusers-integration.md, "The fast decoder and
encoder in diffusers"): `fast_decode` (`enable_fast_decode` / `disable_fast_decode`), `fast_encode`
(`enable_fast_encode` / `disable_fast_encode`) and `route`, the routing of a VAE method to this package that both share.
No FastVideo."""
