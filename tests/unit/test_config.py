

def test_a_gpu_run_reserves_trainer_cpus_for_its_threads_unless_told():
    """Pins: with --engine-backend sglang a trainer rank reserves 4 CPUs (its torch threads: rank 0's
    weight export runs on them) unless --num-cpus-trainer is given; a CPU run and a preset keep theirs.
    Guards: a GPU rank reserved 1 CPU, so Ray's OMP_NUM_THREADS=1 made its export single-threaded
    in a pod with 8 CPUs per GPU."""
    from miles_core.config import parse_flags

    gpu = parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang"], check=False)
    assert gpu.run.num_cpus_trainer == 4.0 and gpu.run.rank_threads == 4
    told = parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang", "--num-cpus-trainer", "2"], check=False)
    assert told.run.num_cpus_trainer == 2.0
    cpu = parse_flags(["--preset", "tiny-reverse4"], check=False)
    assert cpu.run.num_cpus_trainer == 1.0 and cpu.run.rank_threads == 1
    assert parse_flags(["--preset", "smollm2-arith"], check=False).run.num_cpus_trainer == 2.0
    assert parse_flags(["--preset", "tiny-reverse4", "--num-cpus-trainer", "0.5"], check=False).run.rank_threads == 1
