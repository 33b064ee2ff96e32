"""The parts of :class:`torchyard.client.Client`, one module per area of the API."""
