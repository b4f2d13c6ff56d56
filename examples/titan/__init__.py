"""torchtitan's llama3 under ``elastic.torch.Manager``: its model and parallelize code on the
Manager's mesh (``model``) and the user's training loop (``job``)."""
