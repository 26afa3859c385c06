"""HTTP routers, one per concern: text (translate, generate), images (classify), admin (models, health, metrics)."""
