"""A user's own environment, as a separate package would ship it: nothing in the project names it."""
