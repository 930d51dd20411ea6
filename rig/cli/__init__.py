"""invoke collections, one module per area; tasks.py only assembles them."""
