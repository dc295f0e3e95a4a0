"""The parts a peer is wired from, each built whole, once, in the order the helper processes' fork needs
(`startup.start`): the workload (data, shapes), the helper processes, then the model-sized tensors, the merger,
the DiLoCo loop, the checkpoints and the join, and finally the stay that trains (`stay.Stay`)."""
