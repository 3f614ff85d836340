defmodule Moat.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    env = Application.get_all_env(:moat)
    Moat.Compiler.Cache.init()

    children =
      if Keyword.get(env, :start_worker, true), do: [{Moat.Worker, name: Moat.Worker}], else: []

    Supervisor.start_link(children,
      strategy: :one_for_one,
      name: Moat.Supervisor,
      max_restarts: Keyword.get(env, :max_restarts, 20),
      max_seconds: Keyword.get(env, :max_seconds, 5)
    )
  end
end
