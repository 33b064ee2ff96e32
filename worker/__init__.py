"""Node-side code of torchyard: the worker agent and the trainer that torchrun starts."""
