"""The draft service: hosts the draft model and proposes tokens."""
