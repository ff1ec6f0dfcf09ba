"""a run's own analysis: for ranks that NCCL couples, the job's prediction and findings (its ranks replayed
together), beside each rank's

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table('runs') as batch_op:
        batch_op.add_column(sa.Column('analysis', sa.JSON(), nullable=False, server_default='{}'))


def downgrade():
    with op.batch_alter_table('runs') as batch_op:
        batch_op.drop_column('analysis')
