//! `podlink`: the node agent and its operator commands (see [`podlink_agent::cli`]).

fn main() -> anyhow::Result<()> {
    podlink_agent::cli::main()
}
