"""a run's ranks analysed together as a job of its own (a worker that dies leaves it to the next); cross-rank
findings stored before their analysis listed its rows, listed now

Revision ID: 0005
Revises: 0004
"""
from datetime import datetime, timezone

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

runs = sa.table('runs', sa.column('id', sa.Integer), sa.column('analysis', sa.JSON),
                sa.column('metadata', sa.JSON))
traces = sa.table('traces', sa.column('id', sa.Integer), sa.column('run_id', sa.Integer))
findings = sa.table('findings', sa.column('id', sa.Integer), sa.column('run_id', sa.Integer),
                    sa.column('category', sa.String), sa.column('title', sa.Text))


def upgrade():
    op.create_table('run_analysis_jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id')
    )
    with op.batch_alter_table('run_analysis_jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_analysis_jobs_status'), ['status'], unique=False)
    _list_and_queue(op.get_bind())


def _list_and_queue(conn: sa.engine.Connection) -> None:
    """Runs of several traces: the straggler rows a folder ingest stored before 0004's analysis listed them are
    listed, and the run is queued for a joint analysis, which replaces them; so is a run whose joint analysis does
    not cover its traces, once it holds every rank its capture named."""
    held: dict = {}
    for trace_id, run_id in conn.execute(sa.select(traces.c.id, traces.c.run_id)):
        held.setdefault(run_id, []).append(trace_id)
    stragglers: dict = {}
    # the one cross-rank finding then, titled as recommendations.ranks.straggler titles it
    for finding_id, run_id in conn.execute(sa.select(findings.c.id, findings.c.run_id).where(
            findings.c.category == 'communication', findings.c.title.like('rank % straggles: %'))):
        stragglers.setdefault(run_id, []).append(finding_id)
    now = datetime.now(timezone.utc)
    jobs = sa.table('run_analysis_jobs', sa.column('run_id', sa.Integer), sa.column('status', sa.String),
                    sa.column('attempts', sa.Integer), sa.column('created_at', sa.DateTime(timezone=True)))
    for run_id, analysis, metadata in conn.execute(sa.select(runs.c.id, runs.c.analysis, runs.c.metadata)).all():
        analysis = dict(analysis or {})
        listed = set(analysis.get('cross_finding_ids') or [])
        unlisted = [i for i in stragglers.get(run_id, []) if i not in listed]
        if unlisted:
            analysis['cross_finding_ids'] = sorted(listed | set(unlisted))
            conn.execute(sa.update(runs).where(runs.c.id == run_id).values(analysis=analysis))
        ranks = held.get(run_id, [])
        stale = sorted(analysis.get('trace_ids') or []) != sorted(ranks)
        if len(ranks) >= max(2, _named_world_size(metadata or {})) and (stale or unlisted):
            conn.execute(sa.insert(jobs).values(run_id=run_id, status='queued', attempts=0, created_at=now))


def _named_world_size(metadata: dict) -> int:
    """The world size a run's capture named (trace.load.named_world_size, as this revision read it), else 0."""
    for key in ('profiler_svc', 'distributedInfo'):
        info = metadata.get(key)
        size = info.get('world_size') if isinstance(info, dict) else None
        if type(size) is int and 2 <= size <= 1 << 20:
            return size
    return 0


def downgrade():
    with op.batch_alter_table('run_analysis_jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_analysis_jobs_status'))
    op.drop_table('run_analysis_jobs')
