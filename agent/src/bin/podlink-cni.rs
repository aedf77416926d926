//! `podlink-cni`: podlink's chained CNI plugin (see
//! `podlink_agent::cni::plugin`). Run by the container runtime, never by hand.

fn main() -> std::process::ExitCode {
    podlink_agent::cni::plugin::main()
}
