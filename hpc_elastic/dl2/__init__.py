"""DL² (Peng et al., EuroSys'19): the torch side of the deep-RL slot scheduler.

:mod:`hpc_elastic.policy.dl2` holds the pure part (state, actions, mask, inference loop, :class:`Dl2Policy`);
this package holds the networks (:mod:`.net`), their training in the slot simulator (:mod:`.train`) and the
model file (:mod:`.model_file`). It needs torch.
"""
