"""The goodput simulator: N chips in M learners under per-chip failures, in four modes; the decoupled mode runs
the real round protocol (p2pdiloco.protocol.round) on a simulated clock."""
