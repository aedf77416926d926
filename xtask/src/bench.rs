pub fn run(_r: usize, _j: Option<&std::path::Path>) -> anyhow::Result<()> {
    anyhow::bail!("todo")
}
