"""Every seam below hivemind==1.1.12's public API that the project uses, in one place: what it is, where, and the
test that fails if a hivemind release moves it. tests/unit/test_hivemind_seams.py checks that each test exists,
that the pinned version is the one installed, and that no other private method or attribute of hivemind's
averager is overridden or read in swarm/ without being listed here."""

from __future__ import annotations

from dataclasses import dataclass

PINNED = "1.1.12"  # pyproject.toml pins it: a new release is taken only with this list checked again


@dataclass(frozen=True)
class Seam:
    name: str  # hivemind's name for it
    used_in: str  # our module
    why: str
    test: str  # path::test function that fails if it moves


SEAMS = (
    Seam("DecentralizedAverager._aggregate_with_group", "swarm/island_rounds.py",
         "runs our island (plan, codes, exact sums) once matchmaking formed a group; hivemind's own PowerSGD "
         "averager and its fault-tolerance tests override the same method",
         "tests/integration/test_swarm.py::test_three_peers_stay_bitwise_equal_and_learn"),
    Seam("DecentralizedAverager._running_groups", "swarm/island_rounds.py, swarm/reducer.py",
         "the group's future holds the runner that would serve hivemind's all-reduce parts: set to None, as "
         "hivemind's PowerSGD averager does, since our parts travel through rpc_codes_*",
         "tests/integration/test_swarm.py::test_three_peers_stay_bitwise_equal_and_learn"),
    Seam("DecentralizedAverager._p2p", "swarm/island_rounds.py",
         "the averager process's libp2p handle, for stubs of our own RPCs to the group's members",
         "tests/integration/test_swarm.py::test_three_peers_stay_bitwise_equal_and_learn"),
    Seam("DecentralizedAverager._inner_pipe", "swarm/island_rounds.py",
         "the averager process's command pipe, read whole messages at a time (WholeMessagePipe)",
         "tests/unit/test_averager_pipe.py::test_the_averagers_pipe_reads_a_split_message_whole_and_stays_nonblocking"),
    Seam("DecentralizedAverager._get_current_state_from_host_process", "swarm/island_rounds.py",
         "the averager's channel to the host's state, which our part server serves a part at a time",
         "tests/integration/test_churn.py::test_late_join_bootstrap_death_status_graceful_leave_restart_and_a_kill"),
    Seam("DecentralizedAverager.run / run_in_background", "swarm/island_rounds.py, swarm/averager.py",
         "hivemind ignores SIGINT in the host when it starts the child; we ignore it in the child instead",
         "tests/integration/test_churn.py::test_whole_swarm_restarted_from_checkpoints_continues_where_it_stopped"),
    Seam("DecentralizedAverager.rpc_join_group", "swarm/island_rounds.py",
         "turns away members we rejected or blame, and keeps the join stream open after its last message",
         "tests/unit/test_averager_seams.py::test_members_rejected_left_out_or_blamed_are_turned_away_at_"
         "matchmaking_for_a_while"),
    Seam("Matchmaking._servicer_type.get_stub (servicer_type=type(averager))", "swarm/island_rounds.py",
         "hivemind's matchmaking asks the averager's class for a leader's stub before it asks to join: our "
         "`get_stub` declines leaders our island left out lately, so we do not follow them",
         "tests/unit/test_averager_seams.py::test_a_leader_our_island_left_out_we_do_not_follow"),
    Seam("DecentralizedAverager.rpc_aggregate_part", "swarm/island_rounds.py",
         "hivemind's reducer RPC, refused: our rounds never use it",
         "tests/unit/test_averager_seams.py::test_hivemind_reducer_rpc_takes_no_part_from_anyone"),
    Seam("DecentralizedAverager.rpc_download_state", "swarm/island_rounds.py",
         "hivemind's whole-state download, refused in a swarm with a key (its request has no room for a pass)",
         "tests/unit/test_averager_seams.py::test_in_a_swarm_with_a_key_state_parts_go_only_to_requesters_with_"
         "their_own_valid_pass"),
    Seam("gathered metadata as (bandwidth, mode, user)", "swarm/island_rounds.py",
         "what each member gathered, unwrapped to our record and hivemind's mode (client, or auxiliary: a "
         "reducer node)",
         "tests/unit/test_remote_input.py::test_the_averager_turns_an_undecodable_gathered_record_into_an_"
         "excluded_member"),
    Seam("ServicerBase RPC names from the class name", "faults/averager.py",
         "a subclass speaks the same protocol only under the same class name",
         "tests/unit/test_faults.py::test_a_faulty_averager_speaks_the_production_averagers_protocol"),
    Seam("DHTNode.protocol.call_ping", "swarm/node.py",
         "pings our initial peers again while we see no other peer, inside the DHT process: a node forgets a peer "
         "that stopped answering, and a client whose only public peer restarted would stay alone",
         "tests/integration/test_home_volunteers.py::test_clients_find_their_only_node_again_after_it_restarts_"
         "and_merge_again"),
    Seam("RSASignatureValidator's owner subkey and RSAPublicKey.verify's scheme", "swarm/signing.py",
         "records are signed under `[owner:<key>]` (PUBLIC_KEY_REGEX) by a key loaded from the peer's libp2p "
         "identity file, which signs as hivemind's RSAPrivateKey does (PSS, SHA-256, base64): hivemind has no way "
         "to load a private key from bytes",
         "tests/unit/test_signed_records.py::test_only_the_owner_of_a_subkey_can_store_under_it"),
    Seam("DHTNode.protocol.routing_table", "swarm/node.py",
         "whether any initial peer answered: the routing table's size, read inside the DHT process",
         "tests/unit/test_cli.py::test_unreachable_initial_peer_fails_fast_and_clearly"),
)
