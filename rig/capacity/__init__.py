"""What a plan needs of the machine it runs on, computed before anything starts."""
