"""The lowest layer of the rank side: collectives, the torch.distributed rendezvous and progress events. It
imports nothing else of the rank side."""
